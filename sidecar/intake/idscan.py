"""Size a large prompt in the raw body: an ``input_ids`` array without making a Python int of each id,
a ``text`` string without holding it decoded.

Why: admission needs only how many ids a prompt has, and decoding a 500K-id body builds 500K Python
ints (~18 MB for a 3.6 MB body, ~40 ms with orjson, the GIL held throughout): issue #12 measured the
sidecar's peak RSS at ~10x such a body and its added time to first byte at ~64 ms. The scan runs at
C speed over the bytes (numpy: a byte-class lookup and two counts, a bounded window at a time) and
accepts only a flat array of non-negative decimal integers separated by single commas (any JSON
whitespace around them); anything else - a batch of lists, a negative or fractional id, a string, an empty array - is
left to the full parser and its exact error messages. The count is exact (one per run of digits);
an array malformed in a way that still balances (``[1,,2 3]``) is forwarded, and the engine's JSON
parser refuses it before any prefill.

A ``text`` string is validated and measured (its exact UTF-8 size, what the bytes bound reads) by
decoding it a window at a time with orjson, cut where no escape, UTF-8 sequence or surrogate pair is
split; the whole ``str`` is made only when a tokenizer must read it. Decoded at once, a 500K-token
prompt doubled the body in memory while it was counted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import orjson

# The key at the start of an array. Inside a JSON string a quote is always escaped, so these bytes
# match only a real key; the caller still checks that it was the top-level one.
_KEY = re.compile(rb'"input_ids"\s*:\s*\[')
# Byte classes: 1 a digit, 2 a comma, 3 JSON whitespace, 0 anything else (refused).
_CLASSES = np.zeros(256, np.uint8)
_CLASSES[list(b"0123456789")] = 1
_CLASSES[ord(",")] = 2
_CLASSES[list(b" \t\n\r")] = 3
# An id of 19 digits or more may not fit int64: the full parser decides it (orjson reads it as a float,
# which the parser refuses as a token id), so both paths answer the same.
LONG_ID_DIGITS = 19
# Bytes classified at a time: bounds the scan's own memory to a few times this, whatever the body.
WINDOW = 256 * 1024


@dataclass(frozen=True, slots=True)
class CountedIds:
    """A token-id array known only by its length (the ids themselves stay in the forwarded body)."""

    n: int

    def __len__(self) -> int:
        return self.n


def find_ids(body: bytes | bytearray) -> tuple[int, int, int] | None:
    """``(start, end, count)`` of the first ``"input_ids": [...]`` flat id array in ``body``: the
    array is ``body[start:end]`` (brackets included) and holds ``count`` ids; None when there is no
    such array or it is not a plain list of non-negative integers."""
    at = body.find(b'"input_ids"')  # memchr-fast; the pattern is matched only from there
    m = _KEY.search(body, at) if at >= 0 else None
    if m is None:
        return None
    start = m.end() - 1
    end = body.find(b"]", start)
    if end < 0:
        return None
    ints = commas = 0
    run = 0  # digits at the end of the windows so far (an id the next window may continue)
    for lo in range(start + 1, end, WINDOW):
        classes = _CLASSES[np.frombuffer(body, np.uint8, count=min(WINDOW, end - lo), offset=lo)]
        if not classes.all():
            return None
        digit = classes == 1
        # An id starts at each digit that does not follow a digit (the window's first byte: the last one).
        ints += int(np.count_nonzero(digit[1:] > digit[:-1])) + int(digit[0] and run == 0)
        commas += int(np.count_nonzero(classes == 2))
        # The longest digit run, from the gaps between non-digits (a run may continue across windows).
        # A regex for 19 digits over the whole array cost ~100 ms on 500K ids (it restarts at every
        # digit); these are a few vector operations per window.
        other = np.flatnonzero(~digit)
        if other.size == 0:
            run += digit.size
        else:
            longest = max(run + int(other[0]), int(np.diff(other).max()) - 1 if other.size > 1 else 0)
            if longest >= LONG_ID_DIGITS:
                return None
            run = digit.size - 1 - int(other[-1])
        if run >= LONG_ID_DIGITS:
            return None
    # One more id than commas, each comma between two ids: `[1,,2]`, `[,1]`, `[1 2]`, `[]` all fail.
    if ints == 0 or ints != commas + 1 or _separator_runs(body, start + 1, end):
        return None
    return start, end + 1, ints


def _separator_runs(body: bytes | bytearray, lo: int, hi: int) -> bool:
    """A comma right after the opening bracket or right before the closing one (`[,1]` counts as one
    id after one comma and would balance a later `1 2`): refused."""
    head = body[lo : min(hi, lo + 64)].lstrip()
    tail = body[max(lo, hi - 64) : hi].rstrip()
    return head.startswith(b",") or tail.endswith(b",")


# Top-level "text" string literal. A quote inside a JSON string is always escaped, so this matches a
# real key (the caller checks it was the top-level one).
_TEXT_KEY = re.compile(rb'"text"\s*:\s*"')
_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")


@dataclass(frozen=True, slots=True)
class JsonText:
    """A prompt string left encoded in the body it came in: its exact UTF-8 size was measured while
    validating it, window by window; the ``str`` is made only if a tokenizer must read it (:meth:`text`)."""

    body: bytes | bytearray
    start: int  # the opening quote
    end: int  # one past the closing quote
    utf8_len: int

    def text(self) -> str:
        value = orjson.loads(self.body[self.start : self.end])
        assert isinstance(value, str)
        return value


def find_text(body: bytes | bytearray) -> tuple[int, int, int] | None:
    """``(start, end, utf8_len)`` of the first ``"text": "..."`` string literal in ``body``
    (``body[start:end]``, quotes included), validated as JSON and measured as the UTF-8 size of the
    string it decodes to, without ever holding more than a window of it decoded; None when there is
    none or it is not valid (the full parser then gives its exact error)."""
    at = body.find(b'"text"')
    m = _TEXT_KEY.search(body, at) if at >= 0 else None
    if m is None:
        return None
    start = m.end() - 1
    end = _closing_quote(body, start + 1)
    if end is None:
        return None
    size = 0
    lo = start + 1
    while lo < end:
        hi = _cut(body, lo, min(lo + WINDOW, end), end)
        window = np.frombuffer(body, np.uint8, count=hi - lo, offset=lo)
        if window.min() >= 0x20 and window.max() < 0x80 and not (window == 0x5C).any():
            size += hi - lo  # printable ASCII without escapes: valid, one byte a character
            lo = hi
            continue
        try:
            part = orjson.loads(b'"' + body[lo:hi] + b'"')
        except orjson.JSONDecodeError:
            return None  # a control character, bad escape or UTF-8, lone surrogate: the parser says which
        size += len(part) if part.isascii() else len(part.encode("utf-8", "surrogatepass"))
        lo = hi
    return start, end + 1, size


def _closing_quote(body: bytes | bytearray, pos: int) -> int | None:
    """The index of the quote that ends a string whose content starts at ``pos``. Past the first 64
    quotes (a prompt quoting JSON has an escaped one every few bytes), they are found a window at a
    time with numpy."""
    for _ in range(64):  # most prompts have few quotes: find them one by one
        q = body.find(b'"', pos)
        if q < 0:
            return None
        if _unescaped(body, q):
            return q
        pos = q + 1
    n = len(body)
    while pos < n:
        hi = min(pos + WINDOW, n)
        window = np.frombuffer(body, np.uint8, count=hi - pos, offset=pos)
        for q in (np.flatnonzero(window == 0x22) + pos).tolist():
            if _unescaped(body, q):
                return q
        pos = hi
    return None


def _unescaped(body: bytes | bytearray, q: int) -> bool:
    """The quote at ``q`` ends the string: an even run of backslashes (none, most often) before it."""
    slashes = 0
    while body[q - 1 - slashes] == 0x5C:
        slashes += 1
    return slashes % 2 == 0


def _cut(body: bytes | bytearray, lo: int, hi: int, end: int) -> int:
    """A window end at or a few bytes before ``hi`` that splits neither an escape, a UTF-8 sequence
    nor a surrogate pair, so that each window decodes on its own to exactly its part of the string:
    where no escape starts in the 6 bytes before, or right at the backslash of one."""
    if hi >= end:
        return end
    for cut in range(hi, max(lo + 1, hi - 16), -1):
        if (body[cut] & 0xC0) == 0x80:
            continue  # inside a UTF-8 sequence
        if body.rfind(b"\\", cut - 6, cut) < 0:
            return cut
        if body[cut] == 0x5C and _unescaped(body, cut) and not _HIGH_SURROGATE.fullmatch(body, cut - 6, cut):
            return cut
    return end  # nowhere to cut (never for text; bytes that are not): the rest as one window
