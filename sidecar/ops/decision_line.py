"""The decision log's line: one JSON object per decision, and its shape in this one place.

Two ways write the same line:

* :func:`decision_record`, a dict: what the process's log pipeline takes (no ``--decision-log`` file),
  the way for a value the fast way does not write, and the reference the fast way is tested against.
* :func:`line_text`, the line as text from the decision's values directly, with the context that
  changes only with a snapshot or the policy written once per change (:func:`context_fragments`,
  :func:`context_text`): what the decision-log file gets, once per gated request. Building the dict,
  rounding four floats and serializing it all was ~65k instructions of a gated request (issue #27).

Both write the same text: ``tests/test_decision_line.py`` checks that ``line_text`` equals
``orjson.dumps`` of the merged record, byte for byte, for generated decisions (every action and
reason, absent values, huge integers, floats that round to integers, NaN and infinities, request ids
with quotes and non-ASCII text). The fast way trusts the declared types of ``Demand``'s and
``LedgerTotals``' counts and ``Demand.exact`` (an ``int`` and a ``bool``); anything else it refuses
(None), and the caller goes the dict's way.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from sidecar.core.decision import Action, Decision, Reason
from sidecar.core.demand import Demand
from sidecar.core.ledger import LedgerTotals
from sidecar.http.answers import decision_fields


def decision_record(
    d: Decision,
    cost: Demand,
    waited_s: float,
    ledger: LedgerTotals,
    context: dict[str, Any],
    ts: float | None = None,
) -> dict[str, Any]:
    """Every input that decided, and nothing of the prompt's text. ``replay`` reads these lines back.
    ``ts``: the wall-clock time of the decision (now if None). One dict display (not a dict updated
    three times): it is built per decision where the log pipeline writes it (issue #27)."""
    return {
        "ts": round(time.time() if ts is None else ts, 3),
        "event": "decision",
        **decision_fields(d, cost),
        "waited_s": round(waited_s, 4),
        "ledger": {
            "requests": ledger.requests,
            "prefill_tokens": ledger.prefill_tokens,
            "projected_bytes": ledger.projected_bytes,
        },
        **context,
    }


# orjson writes an integer in [-2**63, 2**64 - 1] and refuses one outside.
_INT_MIN = -(1 << 63)
_INT_MAX = (1 << 64) - 1

# ``"decision":..,"reason":..`` of each pair, written once.
_VERDICTS = {
    (a, r): f'"decision":"{a._value_}","reason":' + ("null" if r is None else f'"{r._value_}"')
    for a in Action
    for r in (None, *Reason)
}

# JSON of the short strings a check carries (names, notes, limits), written once each: they come from
# a small set (the notes with a figure in them vary more, hence the bound).
_STRINGS: dict[str, str] = {}
_STRINGS_MAX = 4096


def line_text(
    d: Decision, cost: Demand, waited_s: float, ledger: LedgerTotals, ts: float, context: str
) -> str | None:
    """``orjson.dumps(decision_record(d, cost, waited_s, ledger, ctx, ts))`` as text, where ``context``
    is :func:`context_text` of the same context ``ctx`` ("" for none), written from the values without
    the dict: one f-string whose constant parts are the keys. None where a value is one the fast way
    does not write (a number orjson refuses, a string it cannot encode, a type the fields do not
    declare): the caller then takes the dict's way, which writes it as it always did."""
    try:
        rid = cost.request_id
        # A printable id with no quote or backslash is its own JSON (orjson escapes nothing else).
        if not (rid.isprintable() and '"' not in rid and "\\" not in rid):
            rid = orjson.dumps(rid).decode()[1:-1]
        pt, ct, mnt, seq, pri, pb = (
            cost.prompt_tokens,
            cost.cached_tokens,
            cost.max_new_tokens,
            cost.sequences,
            cost.priority,
            cost.projected_bytes,
        )
        lr, lp, lb = ledger.requests, ledger.prefill_tokens, ledger.projected_bytes
        # Every count a JSON integer orjson writes: an OR of non-negative ints is below 2**64 exactly
        # when each is (a float raises TypeError here: refused); a negative one is looked at alone.
        if (pt | ct | mnt | seq | pri | pb | lr | lp | lb) >> 64 and not _fit(
            pt, ct, mnt, seq, pri, pb, lr, lp, lb
        ):
            return None
        hb, ra = d.headroom_bytes, d.retry_after_s
        checks = ",".join([_check(c) for c in d.checks])
        return (
            f'{{"ts":{_r3(ts)},"event":"decision","request_id":"{rid}",{_VERDICTS[d.action, d.reason]},'
            f'"prompt_tokens":{pt},"exact":{"true" if cost.exact else "false"},"cached_tokens":{ct},'
            f'"max_new_tokens":{mnt},"sequences":{seq},"priority":{pri},"projected_bytes":{pb},'
            f'"headroom_bytes":{"null" if hb is None else _num(hb)},'
            f'"retry_after_s":{"null" if ra is None else _num(ra)},"checks":[{checks}],'
            f'"waited_s":{_r4(waited_s)},'
            f'"ledger":{{"requests":{lr},"prefill_tokens":{lp},"projected_bytes":{lb}}}{context}}}'
        )
    except (TypeError, KeyError):  # orjson's refusal (a TypeError), a type or pair the fields do not declare
        return None


def _check(c: Any) -> str:
    """One check's object, as ``decision_fields`` shapes it (``limit`` only where it names one)."""
    need, have, note, limit = c.need, c.have, c.note, c.limit
    text = (
        f'{{"name":{_str(c.name)},"ok":{"true" if c.ok is True else _bool(c.ok)},'
        f'"need":{"null" if need is None else _num(need)},"have":{"null" if have is None else _num(have)},'
        f'"note":{_str(note) if note else "null"}'
    )
    return f'{text},"limit":{_str(limit)}}}' if limit else text + "}"


def _bool(b: Any) -> str:
    if b is False:
        return "false"
    raise TypeError("not a bool")


def _num(x: Any) -> str:
    """A number as orjson writes it (an int as Python does in orjson's range; a float by orjson)."""
    if type(x) is int:
        if _INT_MIN <= x <= _INT_MAX:
            return str(x)
        raise TypeError("integer out of range")
    return orjson.dumps(x).decode()


def _str(s: str) -> str:
    """A short string's JSON, kept (the set of names, notes and limits is small)."""
    text = _STRINGS.get(s)
    if text is None:
        text = orjson.dumps(s).decode()
        if len(_STRINGS) < _STRINGS_MAX:
            _STRINGS[s] = text
    return text


def _fit(*ints: int) -> bool:
    return min(ints) >= _INT_MIN and max(ints) <= _INT_MAX


# Rounded floats. ``round(x, n)`` and the ``.nf`` format both take the correctly rounded decimal of
# ``x`` with n places (CPython's dtoa, mode 3); below 1e10 that decimal has at most 14 significant
# digits, so the shortest text of the rounded float, which orjson writes, is that decimal without its
# trailing zeros. Beyond (and NaN, the infinities), orjson writes the rounded float itself.


def _r3(x: float) -> str:
    """The text orjson writes for ``round(x, 3)``."""
    if -1e10 < x < 1e10:
        s = f"{x:.3f}".rstrip("0")
        return s + "0" if s[-1] == "." else s
    return orjson.dumps(round(x, 3)).decode()


def _r4(x: float) -> str:
    """The text orjson writes for ``round(x, 4)``."""
    if -1e10 < x < 1e10:
        s = f"{x:.4f}".rstrip("0")
        return s + "0" if s[-1] == "." else s
    return orjson.dumps(round(x, 4)).decode()


def _age(x: float) -> str:
    """A signal's age as the context writes it: rounded to 3 places, 0.0 for one below zero (a
    reading stamped after ``now``) or NaN."""
    return _r3(x) if x > 0.0 else "0.0"


def context_fragments(
    head: dict[str, Any], engine: dict[str, Any] | None, gpu: dict[str, Any] | None
) -> tuple[str, str, str, str] | None:
    """The decision log's context parts that change only with a snapshot or the policy (the head,
    the engine's and the GPU's fields, without their ages; None for a signal not read) as JSON, once
    per snapshot. :func:`context_text` puts them together with what changes per decision: the head's
    members up to the held count's key, the engine's object left open for its ``age_s`` (last), the
    GPU's likewise after the engine's close, and the closing brace of the last (an absent signal:
    ``null``, no age). None where orjson cannot write them (the line then goes the dict's way)."""
    try:
        first = "," + (orjson.dumps(head).decode()[1:-1] + "," if head else "") + '"held":'
        return (
            first,
            ',"engine":null' if engine is None else ',"engine":' + _open(engine),
            ("}," if engine is not None else ",") + ('"gpu":null' if gpu is None else '"gpu":' + _open(gpu)),
            "}" if gpu is not None else "",
        )
    except TypeError:
        return None


def _open(fields: dict[str, Any]) -> str:
    """``fields`` as a JSON object left open for one more member, ``age_s``."""
    return orjson.dumps(fields).decode()[:-1] + (',"age_s":' if fields else '"age_s":')


def context_text(
    parts: tuple[str, str, str, str], held: int, engine_age: float | None, gpu_age: float | None
) -> str:
    """The context's members as :func:`line_text` ends a line with them (a leading comma): the parts
    of :func:`context_fragments`, the held count, and each signal's age (None: not read)."""
    return (
        f"{parts[0]}{held}{parts[1]}{'' if engine_age is None else _age(engine_age)}"
        f"{parts[2]}{'' if gpu_age is None else _age(gpu_age)}{parts[3]}"
    )
