"""Count a request's prompt tokens: exactly when we can, with a conservative upper bound when we cannot.

The cost model charges a request by its prompt tokens (KV slots, prefill chunks, gather temporaries
that grow with the whole context), so an under-count admits a request that does not fit, the very
failure this sidecar exists to prevent, while an over-count only holds or rejects a little early.
Every method here therefore either is exact or errs upwards, and says which (``TokenCount.exact``).

Methods, cheapest exact one first (:meth:`PromptCounter.count`):

1. ``declared``: the ``emulator.prompt_tokens`` extension or a bare explain body. The client states
   its size; it is how the project's emulator and load generators describe 500K-token prompts
   without sending megabytes (whether to trust it is decided when parsing, ``accept_emulator``).
2. ``input_ids`` / ``input_embeds``: the engine will tokenize nothing, so the length is the count.
3. ``tokenizer``: a local HF ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``): the one the
   policy names, else the one in the model directory the engine reports in ``/server_info`` when this
   host can read it (:meth:`PromptCounter.adopt_engine_model`). Exact for text prompts; for chat, the
   contents are exact and the template is bounded. Prompts over ``thread_threshold_chars`` are
   encoded in a worker thread.
4. ``engine``: SGLang's own ``/tokenize`` (0.5.5+), **only when the policy opts in**
   (``use_engine_tokenize``): every call costs the engine a second tokenizer pass on its own event
   loop and ships the prompt again. Through an injected async callable, so the app wires it to its
   own connection pool (never the scraper's) and this module stays free of I/O. It applies the
   server's own chat template, so chat counts are exact too. A 404 is remembered (0.5.1 has no such
   endpoint) so the engine is not asked again; any other failure falls through for this request only.
5. ``bytes``: ``ceil(utf8_bytes / bytes_per_token)``, a bound that needs nothing but the text.

Counting only when the count decides: when an exact method would cost a tokenizer pass (3 or 4), the
caller may pass ``admits``; the counter first offers it ``bound``, a strict upper bound (every token of
a byte-level BPE, SentencePiece-with-byte-fallback or word-level tokenizer is at least one UTF-8 byte,
so the prompt's bytes, plus the template bounds, can only over-count), and tokenizes only when that
bound would not be admitted. An open gate then costs no tokenizer pass at all.

Chat templates add tokens the contents do not show: per message (ChatML's ``<|im_start|>role\\n`` ...
``<|im_end|>\\n`` is 5 tokens on Qwen), per request (the generation prompt ``<|im_start|>assistant\\n``,
Qwen3's empty ``<think>\\n\\n</think>\\n\\n`` block, Qwen2.5's injected default system prompt of ~20
tokens), and when ``tools`` are present (Qwen's tool-use instructions, ~150 tokens, plus the tools'
JSON, which is counted as text). Without the engine's template those are added as configurable
bounds, set above what the Qwen templates emit so that the result stays an upper bound.

Multimodal parts (an image, video or audio part in a chat message, an ``image_data`` item in
/generate) are not text: the processor expands each into a number of tokens that depends on the
image size. Each adds ``tokens_per_media_item``; the default 16,384 is the cap of Qwen2-VL/2.5-VL's
processor (one token per 28x28-pixel patch, ``max_pixels`` 12,845,056 = 16,384 x 28 x 28), so any
default-configured image fits under it. A long video can exceed it; lanes that serve video should
raise it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from sidecar.core.values import fast_init, positional
from sidecar.intake.body import GenerationRequest
from sidecar.intake.idscan import JsonText

__all__ = [
    "CounterConfig",
    "EngineTokenize",
    "PromptCounter",
    "TokenCount",
    "TokenizerLoadError",
    "find_tokenizer_file",
    "load_tokenizer",
]

log = logging.getLogger(__name__)

# `engine_tokenize(payload)` posts `payload` to the engine's /tokenize and returns its `count`;
# it returns None when the engine has no such endpoint (HTTP 404/405) and raises on anything else.
EngineTokenize = Callable[[dict[str, Any]], Awaitable[int | None]]

_TEXT_PART_TYPES = frozenset({"text", "input_text"})


@fast_init
@dataclass(frozen=True, slots=True)
class TokenCount:
    """A prompt's token count; ``exact`` is False when it is an upper bound, ``method`` says how."""

    tokens: int
    exact: bool
    method: str


# The common count's constructor, positional (core.values.positional: ~1.5x cheaper than TokenCount(...)).
_make_count = positional(TokenCount)


@dataclass(frozen=True, slots=True)
class CounterConfig:
    """How :class:`PromptCounter` counts. Every default is an upper bound on what it stands for.

    - ``tokenizer_path``: the lane's ``tokenizer.json`` (the one the engine loads); None: no local
      tokenizer.
    - ``tokenizer_from_engine``: with no ``tokenizer_path``, use the ``tokenizer.json`` of the model the
      engine reports in ``/server_info`` (``tokenizer_path``/``model_path``: a local directory, or a
      Hugging Face id found in this host's HF cache) when it is readable.
    - ``use_engine_tokenize``: ask the engine's ``/tokenize`` when there is no local tokenizer. Off by
      default: it costs the engine a tokenizer pass on its own event loop for every text prompt.
    - ``bytes_per_token``: the fallback divisor, 2.5. Qwen-family BPE (152K vocabulary) averages ~3.5-4.5
      UTF-8 bytes per token on English and code, while CJK text runs ~1.5-3 (a CJK character is 3 bytes
      and often one token on its own). Dividing by 2.5 over-counts most text by 40-80 %, conservative
      for memory, yet a real 500K-token English prompt (~2 MB) is counted as ~800K, not as a
      multi-million-token request that no lane would admit. Pure-CJK text can still be under-counted
      (down to ~1.5 bytes/token); lanes serving it should configure a tokenizer or a lower divisor.
    - ``chat_overhead_tokens_per_message``: template tokens around each message. ChatML costs 5 on
      Qwen; 8 also covers role names that split into two tokens and a ``name`` field's framing.
    - ``chat_overhead_tokens_fixed``: template tokens per chat request: Qwen's generation prompt (3),
      Qwen3's empty think block (~6), Qwen2.5's injected default system prompt (~20); 64 bounds them.
    - ``chat_overhead_tokens_tools``: added once when the request has ``tools``: Qwen's tool-use
      instruction boilerplate is ~150 tokens; the tools' own JSON is counted separately as text.
    - ``tokens_per_media_item``: each image/video/audio item, 16,384 (Qwen2-VL's default pixel cap).
    - ``thread_threshold_chars``: prompts longer than this (16 Ki characters, ~4K tokens, about 1 ms of
      encoding; characters because measuring UTF-8 bytes would itself walk the text) are encoded in a
      worker thread, so a 500K-token prompt (~0.5-1 s to encode) does not stall every other request
      on the event loop (the loop's budget is 5 ms, issue #12).
    - ``engine_tokenize_timeout_s``: give up on the engine's answer after this long and use the bound.
    - ``special_tokens_bound``: tokens a tokenizer may add around a text prompt (BOS/EOS and the like)
      on top of one per byte, in the strict ``bound``.
    """

    tokenizer_path: str | Path | None = None
    tokenizer_from_engine: bool = True
    use_engine_tokenize: bool = False
    bytes_per_token: float = 2.5
    chat_overhead_tokens_per_message: int = 8
    chat_overhead_tokens_fixed: int = 64
    chat_overhead_tokens_tools: int = 256
    tokens_per_media_item: int = 16_384
    thread_threshold_chars: int = 16 * 1024
    engine_tokenize_timeout_s: float = 10.0
    special_tokens_bound: int = 8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bytes_per_token) and self.bytes_per_token > 0):
            raise ValueError(f"bytes_per_token must be a positive number, got {self.bytes_per_token!r}")
        for name in (
            "chat_overhead_tokens_per_message",
            "chat_overhead_tokens_fixed",
            "chat_overhead_tokens_tools",
            "tokens_per_media_item",
            "thread_threshold_chars",
            "special_tokens_bound",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)!r}")
        if self.engine_tokenize_timeout_s <= 0:
            raise ValueError(
                f"engine_tokenize_timeout_s must be positive, got {self.engine_tokenize_timeout_s!r}"
            )


class TokenizerLoadError(Exception):
    """The configured ``tokenizer.json`` cannot be loaded; raised at start-up, never guessed around."""


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a ``tokenizer.json`` for counting, with truncation and padding switched off.

    Many published ``tokenizer.json`` files carry a truncation setting (often 512 tokens) meant for
    training; left on, it would silently cap every count at that length.
    """
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise TokenizerLoadError(f"cannot load tokenizer {path}: {exc}") from exc
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def find_tokenizer_file(path: str) -> Path | None:
    """The ``tokenizer.json`` that ``path`` names (a file, a model directory, or an HF id), if readable.

    An HF id (``Qwen/Qwen3-8B``) is looked up in this host's Hugging Face cache
    (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``), newest snapshot first,
    which is where SGLang downloads it when the engine runs on the same host.
    """
    if not path:
        return None
    p = Path(path).expanduser()
    candidates = [p] if p.name == "tokenizer.json" else [p / "tokenizer.json"]
    if not p.is_absolute() and path.count("/") == 1:
        hub = os.environ.get("HF_HUB_CACHE") or str(
            Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"
        )
        snapshots = Path(hub).expanduser() / ("models--" + path.replace("/", "--")) / "snapshots"
        with contextlib.suppress(OSError):
            found = sorted(snapshots.glob("*/tokenizer.json"), key=lambda f: f.stat().st_mtime, reverse=True)
            candidates += found
    for c in candidates:
        with contextlib.suppress(OSError):
            if c.is_file() and os.access(c, os.R_OK):
                return c
    return None


def _utf8_len(text: str | JsonText) -> int:
    if isinstance(text, JsonText):
        return text.utf8_len  # measured in the raw body, the same way
    # JSON allows lone surrogates ("\ud800"); count them as the 3 bytes they would take.
    return len(text.encode("utf-8", "surrogatepass"))


def _decoded(texts: list[str | JsonText]) -> list[str]:
    """The texts as ``str``: a prompt left encoded in its body is decoded only here, when a tokenizer
    (ours or the engine's) must read it."""
    return [t.text() if isinstance(t, JsonText) else t for t in texts]


@dataclass(slots=True)
class _ChatParts:
    """A chat request flattened to what gets counted: texts, template overheads, media items."""

    texts: list[str]
    overhead: int
    media: int


class PromptCounter:
    """Counts prompt tokens by the cheapest exact method available, else a documented upper bound.

    One instance per lane, shared by all requests. ``tokenizer`` may be given directly (tests, or a
    proxy that already loaded it); otherwise ``config.tokenizer_path`` is loaded here, so a missing or
    broken file fails at start-up with :class:`TokenizerLoadError` rather than on the first request.

    ``config`` may be replaced on a policy reload: :meth:`load_for` loads a changed ``tokenizer_path``
    (a tokenizer.json is MBs of JSON, 0.1-1 s to load: off the event loop), then :meth:`swap` installs
    it; :meth:`reconfigure` does both from a coroutine, the ``config`` setter on the calling thread. A
    file that cannot be loaded raises :class:`TokenizerLoadError` and leaves the running configuration
    and tokenizer in force.
    """

    def __init__(
        self,
        config: CounterConfig | None = None,
        *,
        engine_tokenize: EngineTokenize | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        config = config or CounterConfig()
        if tokenizer is None and config.tokenizer_path is not None:
            tokenizer = load_tokenizer(config.tokenizer_path)
        self._config = config
        self._policy_tokenizer = tokenizer
        self._engine_tokenizer: Tokenizer | None = None
        self.engine_tokenizer_source: str | None = None  # the file adopted from /server_info, if any
        self._engine_tokenize = engine_tokenize
        self._engine_missing = False
        self._refresh()

    def _refresh(self) -> None:
        """What ``count_now`` reads on every request, re-read here whenever a source of it changes
        (the configuration, a tokenizer, the engine's /tokenize): whether the bytes bound is the only
        count there is (no tokenizer, no engine to ask), and the bound's figures."""
        self._bytes_only = self._tokenizer is None and not self.engine_tokenize_available
        # Whether ``count_now`` may ask its ``admits`` at all (it never does where the bytes bound is the
        # only count): the proxy builds that callback per request only then.
        self.asks_admits = not self._bytes_only
        self._bytes_per_token = self._config.bytes_per_token
        self._per_media = self._config.tokens_per_media_item

    @property
    def config(self) -> CounterConfig:
        return self._config

    @config.setter
    def config(self, config: CounterConfig) -> None:
        self.swap(config, self.load_for(config))

    def load_for(self, config: CounterConfig) -> Tokenizer | None:
        """The tokenizer ``config`` names, loaded now if it differs from the running one (blocking:
        call it off the event loop). Raises :class:`TokenizerLoadError`; nothing is changed here."""
        if config.tokenizer_path == self._config.tokenizer_path:
            return self._policy_tokenizer
        return None if config.tokenizer_path is None else load_tokenizer(config.tokenizer_path)

    async def reconfigure(self, config: CounterConfig) -> None:
        """Switch to ``config``, loading a changed tokenizer in a worker thread first."""
        self.swap(config, await asyncio.to_thread(self.load_for, config))

    def swap(self, config: CounterConfig, tokenizer: Tokenizer | None) -> None:
        """Install ``config`` and its already-loaded tokenizer (None: the policy names none)."""
        self._config = config
        self._policy_tokenizer = tokenizer
        self._refresh()

    @property
    def _tokenizer(self) -> Tokenizer | None:
        """The policy's tokenizer, else the engine's model's one (when allowed and found)."""
        if self._policy_tokenizer is not None or self._config.tokenizer_path is not None:
            return self._policy_tokenizer
        return self._engine_tokenizer if self._config.tokenizer_from_engine else None

    @property
    def has_tokenizer(self) -> bool:
        return self._tokenizer is not None

    async def adopt_engine_model(self, paths: Iterable[str]) -> str | None:
        """Load the ``tokenizer.json`` of the model the engine serves, if this host can read it.

        ``paths``: what ``/server_info`` reports (``tokenizer_path``, ``model_path``), best first: a
        directory, a ``tokenizer.json`` file, or a Hugging Face id looked up in the local HF cache.
        Loaded in a worker thread. Returns the file adopted, or None (then counting stays as it was:
        the policy's tokenizer, ``/tokenize`` when opted in, or the bytes bound).
        """
        for candidate in paths:
            found = find_tokenizer_file(candidate)
            if found is None:
                continue
            if str(found) == self.engine_tokenizer_source:
                return self.engine_tokenizer_source
            try:
                tokenizer = await asyncio.to_thread(load_tokenizer, found)
            except TokenizerLoadError as exc:
                log.warning("engine's model tokenizer unusable (%s); counting without it", exc)
                continue
            self._engine_tokenizer, self.engine_tokenizer_source = tokenizer, str(found)
            self._refresh()
            log.info("counting prompt tokens with %s (the engine's model, from /server_info)", found)
            return self.engine_tokenizer_source
        return None

    @property
    def engine_tokenize_available(self) -> bool:
        """False when not configured or wired, or once the engine answered 404 (not asked again)."""
        return (
            self._config.use_engine_tokenize
            and self._engine_tokenize is not None
            and not self._engine_missing
        )

    def reset_engine_tokenize(self) -> None:
        """Ask the engine again, e.g. after it restarted with a new version (``/server_info`` changed)."""
        self._engine_missing = False
        self._refresh()

    def bound(self, req: GenerationRequest) -> TokenCount | None:
        """A strict upper bound on the prompt's tokens, when counting exactly would cost a tokenizer pass.

        None when :meth:`count` is already cheap (a declared size, token ids, or no tokenizer at all,
        where the count is the bytes bound itself). One token per UTF-8 byte plus
        ``special_tokens_bound`` per text (the template bounds for chat): no tokenizer of the kinds
        named in the module docstring can emit more.
        """
        if (
            req.declared_prompt_tokens is not None
            or req.input_embeds_tokens is not None
            or req.prompt_token_ids is not None
            or req.batch_token_ids
        ):
            return None
        if not (self._tokenizer is not None or self.engine_tokenize_available):
            return None
        per_item = self._config.tokens_per_media_item
        if req.messages is not None:
            parts = self._chat_parts(req)
            tokens = sum(_utf8_len(t) for t in parts.texts) + parts.overhead + parts.media * per_item
            return TokenCount(tokens, False, "bound")
        texts = [req.prompt_text] if req.prompt_text is not None else list(req.batch_texts)
        if not texts:
            return None
        special = self._config.special_tokens_bound
        tokens = sum(_utf8_len(t) + special for t in texts) + req.media_items * per_item
        return TokenCount(tokens, False, "bound")

    async def count(
        self, req: GenerationRequest, *, admits: Callable[[TokenCount], bool] | None = None
    ) -> TokenCount:
        """The prompt tokens of ``req`` (summed over a batch), by the first method that applies.

        ``admits``: would the gate admit a request of this many tokens right now? When it says yes
        to the strict :meth:`bound`, that bound is the answer and nothing is tokenized.
        """
        found = self.count_now(req, admits=admits)
        if found is not None:
            return found
        if req.messages is not None:
            return await self._count_chat(req)
        texts = [req.prompt_text] if req.prompt_text is not None else list(req.batch_texts)
        if not texts:
            raise ValueError(f"request for {req.path} carries no prompt to count")
        media = req.media_items * self.config.tokens_per_media_item
        exact = req.media_items == 0

        if self._tokenizer is not None:
            counted = await self._tokenize(_decoded(texts), add_special_tokens=True)
            if counted is not None:
                return TokenCount(counted + media, exact, "tokenizer")
        if self.engine_tokenize_available:
            total = 0
            for text in _decoded(texts):
                payload: dict[str, Any] = {"prompt": text, "add_special_tokens": True}
                if req.model is not None:
                    payload["model"] = req.model
                answer = await self._ask_engine(payload)
                if answer is None:
                    break
                total += answer
            else:
                return TokenCount(total + media, exact, "engine")
        return TokenCount(self._bytes_bound(texts) + media, False, "bytes")

    def count_now(
        self, req: GenerationRequest, *, admits: Callable[[TokenCount], bool] | None = None
    ) -> TokenCount | None:
        """What :meth:`count` answers without waiting for anything (the proxy's common case: no
        coroutine per request): the body's own count (declared, embeddings, ids), the bound ``admits``
        takes, or the byte bound where there is neither a tokenizer nor an engine to ask. None where
        :meth:`count` would tokenize or ask the engine (then call it, without ``admits``: asked here)."""
        if req.declared_prompt_tokens is not None:
            return TokenCount(req.declared_prompt_tokens, True, "declared")
        if req.input_embeds_tokens is not None:
            return TokenCount(req.input_embeds_tokens, True, "input_embeds")
        if req.prompt_token_ids is not None:
            return TokenCount(len(req.prompt_token_ids), True, "input_ids")
        if req.batch_token_ids:
            return TokenCount(sum(len(ids) for ids in req.batch_token_ids), True, "input_ids")
        if self._bytes_only:
            # No tokenizer, no engine: the bytes bound is what count() would answer, and bound() is
            # None (nothing to save), so `admits` is not asked.
            text = req.prompt_text
            if type(text) is str:  # the common prompt: one text
                size = len(text) if text.isascii() else _utf8_len(text)
                tokens = math.ceil(size / self._bytes_per_token) + req.media_items * self._per_media
                return _make_count(tokens, False, "bytes")
            if req.messages is not None:
                parts = self._chat_parts(req)
                tokens = self._bytes_bound(parts.texts) + parts.overhead + parts.media * self._per_media
                return TokenCount(tokens, False, "bytes")
        if admits is not None and (upper := self.bound(req)) is not None and admits(upper):
            return upper
        if req.messages is not None or self._tokenizer is not None or self.engine_tokenize_available:
            return None
        texts = [req.prompt_text] if req.prompt_text is not None else list(req.batch_texts)
        if not texts:
            return None  # count() says why
        return TokenCount(
            self._bytes_bound(texts) + req.media_items * self.config.tokens_per_media_item, False, "bytes"
        )

    # --- chat --------------------------------------------------------------------------------

    def _chat_parts(self, req: GenerationRequest) -> _ChatParts:
        config = self.config
        messages = req.messages or []
        texts: list[str] = []
        media = 0
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text")
                    if part.get("type") in _TEXT_PART_TYPES and isinstance(text, str):
                        texts.append(text)
                    else:
                        # Anything that is not text (image_url, video_url, input_audio, or a type
                        # this sidecar does not know) is bounded as a media item: over-count, not under.
                        media += 1
            for key in ("reasoning_content", "name"):
                value = message.get(key)
                if isinstance(value, str):
                    texts.append(value)
            if message.get("tool_calls"):
                texts.append(json.dumps(message["tool_calls"], ensure_ascii=False))
        overhead = config.chat_overhead_tokens_fixed + config.chat_overhead_tokens_per_message * len(messages)
        if req.tools:
            texts.append(json.dumps(req.tools, ensure_ascii=False))
            overhead += config.chat_overhead_tokens_tools
        return _ChatParts(texts=texts, overhead=overhead, media=media)

    async def _count_chat(self, req: GenerationRequest) -> TokenCount:
        parts = self._chat_parts(req)
        media = parts.media * self.config.tokens_per_media_item
        if self._tokenizer is not None:
            # Contents without special tokens: the template (bounded in `overhead`) supplies them.
            counted = await self._tokenize(parts.texts, add_special_tokens=False)
            if counted is not None:
                return TokenCount(counted + parts.overhead + media, False, "tokenizer")
        if self.engine_tokenize_available:
            payload: dict[str, Any] = {"messages": req.messages}
            if req.model is not None:
                payload["model"] = req.model
            answer = await self._ask_engine(payload)
            if answer is not None:
                # The server applied its own template, so only what it cannot see is bounded: the
                # tools (not part of /tokenize's request) and media expansion.
                extra = 0
                if req.tools:
                    extra = self.config.chat_overhead_tokens_tools + self._bytes_bound(
                        [json.dumps(req.tools, ensure_ascii=False)]
                    )
                exact = extra == 0 and media == 0
                return TokenCount(answer + extra + media, exact, "engine")
        return TokenCount(self._bytes_bound(parts.texts) + parts.overhead + media, False, "bytes")

    # --- methods -----------------------------------------------------------------------------

    def _bytes_bound(self, texts: Iterable[str | JsonText]) -> int:
        return sum(math.ceil(_utf8_len(text) / self.config.bytes_per_token) for text in texts)

    async def _tokenize(self, texts: list[str], *, add_special_tokens: bool) -> int | None:
        """Exact count with the local tokenizer; None when it fails (the caller falls through)."""
        if not texts:
            return 0
        tokenizer = self._tokenizer
        assert tokenizer is not None
        size = sum(len(text) for text in texts)
        try:
            if size > self.config.thread_threshold_chars:
                return await asyncio.to_thread(_encode_count, tokenizer, texts, add_special_tokens)
            return _encode_count(tokenizer, texts, add_special_tokens)
        except Exception as exc:  # e.g. a lone surrogate the Rust side cannot take
            log.warning("local tokenizer failed (%s: %s); falling back", type(exc).__name__, exc)
            return None

    async def _ask_engine(self, payload: dict[str, Any]) -> int | None:
        """The engine's count, or None (fall through). A None answer means 404: remember it."""
        ask = self._engine_tokenize
        assert ask is not None
        try:
            async with asyncio.timeout(self.config.engine_tokenize_timeout_s):
                answer = await ask(payload)
        except Exception as exc:  # TimeoutError included: a slow engine must not stall admission
            log.warning("engine /tokenize failed (%s: %s); falling back", type(exc).__name__, exc)
            return None
        if answer is None:
            log.info("engine has no /tokenize; not asking again until reset")
            self._engine_missing = True
            self._refresh()
            return None
        if isinstance(answer, bool) or not isinstance(answer, int) or answer < 0:
            log.warning("engine /tokenize answered %r, not a count; falling back", answer)
            return None
        return answer


def _encode_count(tokenizer: Tokenizer, texts: list[str], add_special_tokens: bool) -> int:
    # encode_batch_fast (tokenizers 0.20+) skips offset tracking; 500K offsets are not free.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return sum(len(encoding.ids) for encoding in encode(texts, add_special_tokens=add_special_tokens))
