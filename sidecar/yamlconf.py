"""YAML files validated by pydantic models, with errors located by file, line and field.

Policies and scenarios are written by people under pressure; "margin: Input should be a valid number"
is not enough, "policy.yaml:27: cost.margin: ..." is.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import yaml
from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A file that cannot be used, with every problem located (file:line: field: message)."""

    kind = "file"

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid {self.kind}\n" + "\n".join(f"  {p}" for p in problems))


def read_text(path: str | Path, error: type[ConfigError] = ConfigError) -> str:
    """A config file's text, or ``error`` saying why it cannot be read."""
    p = Path(path)
    try:
        return p.read_text(encoding="utf-8")
    except OSError as e:
        raise error(str(p), [f"{p}: cannot read: {e.strerror or e}"]) from None


@runtime_checkable
class Located(Protocol):
    """A model with checks across fields, each reported at the field it names (not at the model)."""

    def located_problems(self) -> list[tuple[tuple[str | int, ...], str]]: ...


def load_model(text: str, model: type[M], source: str, error: type[ConfigError] = ConfigError) -> M:
    """Parse YAML text and validate it; raise ``error`` naming the line of each problem.

    Duplicate keys are an error: YAML's loaders keep the last one silently, so a limit written twice
    (the second copy pasted from another lane) would quietly replace the first.
    """
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(e, "problem", None) or str(e)
        raise error(source, [f"{where}: YAML syntax: {problem}"]) from None
    problems = [
        f"{source}:{line}: {'.'.join(map(str, loc))}: duplicate key (first on line {first}); "
        "YAML would silently keep the last one: remove one of them"
        for loc, line, first in _duplicate_keys(root, ())
    ]
    if not isinstance(data, dict):
        raise error(source, [f"{source}:1: expected a mapping at the top, got {type(data).__name__}"])
    try:
        obj = model.model_validate(data)
    except ValidationError as e:
        problems += [_located(source, root, tuple(err["loc"]), err["msg"]) for err in e.errors()]
        raise error(source, problems) from None
    if isinstance(obj, Located):
        problems += [_located(source, root, loc, msg) for loc, msg in obj.located_problems()]
    if problems:
        raise error(source, problems)
    return obj


def _located(source: str, root: Any, loc: tuple[Any, ...], msg: str) -> str:
    field = ".".join(str(p) for p in loc) or "(top level)"
    line = line_of(root, loc)
    where = f"{source}:{line}" if line else source
    # pydantic prefixes a validator's own message with its kind; the person reading wants the message.
    msg = msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")
    return f"{where}: {field}: {msg}"


def _duplicate_keys(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], int, int]]:
    """(location, line, line of the first occurrence) of every key that appears twice in one mapping."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            line = key.start_mark.line + 1
            if name is not None and name != "<<":
                if name in seen:
                    yield (*path, name), line, seen[name]
                else:
                    seen[name] = line
            yield from _duplicate_keys(value, (*path, name))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _duplicate_keys(item, (*path, i))


def line_of(node: Any, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the YAML node at a pydantic error location (the deepest node that exists)."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if k.value == part), None)
            if nxt is None:
                # A missing field (point at its parent) or a union's tag such as "burst" (skip it).
                continue
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            # A discriminated union's tag (e.g. "burst") sits in the location but not in the YAML.
            continue
        line = node.start_mark.line + 1
    return line
