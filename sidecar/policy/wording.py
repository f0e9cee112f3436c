"""What a person reads when a file fails validation: pydantic's errors in the file's own terms.

pydantic speaks of its types ("Input should be a valid dictionary or instance of EngineQueue", "Extra
inputs are not permitted", "NoneType"); whoever edits a policy at 3 a.m. wants the field, what it
expects, what it got and, for a typo, the name they meant (difflib over the section's field names).
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

Loc = tuple[str | int, ...]
MISSING_SECTION = "required section missing"
MISSING_FIELD = "required field missing"


def describe(value: Any) -> str:
    """A YAML value as its writer would name it."""
    if value is None:
        return "nothing (an empty value)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return f"the number {value:g}" if isinstance(value, float) else f"the number {value}"
    if isinstance(value, str):
        return f"the text {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    return "a value of another kind"


def suggest(name: object, known: Sequence[str]) -> str | None:
    """The known name closest to a misspelt one, if any is close enough to be meant."""
    if not isinstance(name, str):
        return None
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    return close[0] if close else None


def model_at(model: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    """The model whose fields sit at ``loc`` (None where the path leaves the models)."""
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return None
        if isinstance(part, int):
            continue  # an item of a list of models
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = _model_in(field.annotation)
    return current


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _fields(model: type[BaseModel] | None) -> list[str]:
    return list(model.model_fields) if model is not None else []


def _num(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _one_of(choices: Sequence[str]) -> str:
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]


# pydantic's error kinds whose message is "expected <this>, got <what the file holds>".
_EXPECTED = {
    **dict.fromkeys(("tuple_type", "list_type", "set_type", "frozen_set_type"), "a list"),
    **dict.fromkeys(("bool_type", "bool_parsing"), "true or false"),
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "a whole number"),
    **dict.fromkeys(("float_type", "float_parsing", "finite_number"), "a finite number"),
    "string_type": "text",
}
_BOUNDS = {
    "greater_than": "greater than",
    "greater_than_equal": "at least",
    "less_than": "less than",
    "less_than_equal": "at most",
}


def humane(err: dict[str, Any], model: type[BaseModel]) -> tuple[Loc, str]:
    """(location, message) for one pydantic error, in the file's terms."""
    loc: Loc = tuple(err["loc"])
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        return loc, _unknown(loc, model)
    if kind == "missing":
        return loc, MISSING_SECTION if model_at(model, loc) is not None else MISSING_FIELD
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        sub = model_at(model, loc)
        if sub is None:
            return loc, f"expected a mapping (name: value), got {describe(value)}"
        return loc, f"expected a section with the fields {', '.join(_fields(sub))}; got {describe(value)}"
    if kind in _EXPECTED:
        return loc, f"expected {_EXPECTED[kind]}, got {describe(value)}"
    if kind in _BOUNDS:
        limit = next(iter((err.get("ctx") or {}).values()), None)
        return loc, f"must be {_BOUNDS[kind]} {_num(limit)}, got {_num(value)}"
    if kind in ("literal_error", "enum"):
        return _choice(loc, value, str((err.get("ctx") or {}).get("expected", "")))
    # A validator's own message: pydantic prefixes it with its kind.
    return loc, err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")


def _unknown(loc: Loc, model: type[BaseModel]) -> str:
    """A key the model does not have: the name meant when one is close, else the names there are."""
    known = _fields(model_at(model, loc[:-1]))
    what = "section" if len(loc) == 1 else "field"
    where = f" in {'.'.join(map(str, loc[:-1]))}" if len(loc) > 1 else ""
    close = suggest(loc[-1], known)
    if close:
        return f"unknown {what}{where}; did you mean {close!r}?"
    return f"unknown {what}{where}; known: {', '.join(known)}" if known else f"unknown {what}{where}"


def _choice(loc: Loc, value: Any, expected_text: str) -> tuple[Loc, str]:
    """One of a fixed set of values, or of keys (``answers.reasons.<reason>``: reported at the key)."""
    expected = [c.strip().strip("'") for c in expected_text.replace(" or ", ", ").split(", ")]
    if loc and loc[-1] == "[key]":
        loc = loc[:-1]
        close = suggest(loc[-1] if loc else value, expected)
        if close:
            return loc, f"unknown key; did you mean {close!r}?"
        return loc, f"unknown key; expected {_one_of(expected)}"
    close = suggest(value, expected)
    tail = f"; did you mean {close!r}?" if close else ""
    return loc, f"expected {_one_of(expected)}, got {describe(value)}{tail}"


def merge_typos(problems: list[tuple[Loc, str]]) -> list[tuple[Loc, str]]:
    """A misspelt required field is two errors to pydantic (the typo unknown, the field missing): one
    line to a person, at the typo, naming the field it meant."""
    meant = {
        (*loc[:-1], msg.split("did you mean ", 1)[1].strip("'?"))
        for loc, msg in problems
        if "did you mean" in msg and msg.startswith("unknown")
    }
    missing = (MISSING_SECTION, MISSING_FIELD)
    return [(loc, msg) for loc, msg in problems if not (msg in missing and loc in meant)]
