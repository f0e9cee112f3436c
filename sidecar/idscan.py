"""Count a large ``input_ids`` array in the raw body, without making a Python int of each id.

Why: admission needs only how many ids a prompt has, and decoding a 500K-id body builds 500K Python
ints (~18 MB for a 3.6 MB body, ~40 ms with orjson, the GIL held throughout): issue #12 measured the
sidecar's peak RSS at ~10x such a body and its added time to first byte at ~64 ms. The scan runs at
C speed over the bytes (numpy: a byte-class lookup and two counts, a bounded window at a time) and
accepts only a flat array of non-negative decimal integers separated by single commas (any JSON
whitespace around them); anything else - a batch of lists, a negative or fractional id, a string, an empty array - is
left to the full parser and its exact error messages. The count is exact (one per run of digits);
an array malformed in a way that still balances (``[1,,2 3]``) is forwarded, and the engine's JSON
parser refuses it before any prefill.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

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
_LONG_ID = re.compile(rb"[0-9]{19}")
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
    m = _KEY.search(body)
    if m is None:
        return None
    start = m.end() - 1
    end = body.find(b"]", start)
    if end < 0:
        return None
    ints = commas = 0
    after_digit = False
    for lo in range(start + 1, end, WINDOW):
        classes = _CLASSES[np.frombuffer(body, np.uint8, count=min(WINDOW, end - lo), offset=lo)]
        if not classes.all():
            return None
        digit = classes == 1
        # An id starts at each digit that does not follow a digit (the window's first byte: the last one).
        ints += int(np.count_nonzero(digit[1:] > digit[:-1])) + int(digit[0] and not after_digit)
        commas += int(np.count_nonzero(classes == 2))
        after_digit = bool(digit[-1])
    # One more id than commas, each comma between two ids: `[1,,2]`, `[,1]`, `[1 2]`, `[]` all fail.
    if ints == 0 or ints != commas + 1 or _separator_runs(body, start + 1, end):
        return None
    if _LONG_ID.search(body, start, end):
        return None
    return start, end + 1, ints


def _separator_runs(body: bytes | bytearray, lo: int, hi: int) -> bool:
    """A comma right after the opening bracket or right before the closing one (`[,1]` counts as one
    id after one comma and would balance a later `1 2`): refused."""
    head = body[lo : min(hi, lo + 64)].lstrip()
    tail = body[max(lo, hi - 64) : hi].rstrip()
    return head.startswith(b",") or tail.endswith(b",")
