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

from sidecar.policy.wording import humane, merge_typos

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
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)
        # Composed once, checked, then constructed from the same nodes (not parsed a second time).
        root = loader.get_single_node()
        _check_graph(root, source, error)
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else f"{source}:1"
        problem = getattr(e, "problem", None) or str(e)
        raise error(source, [f"{where}: YAML syntax: {problem}"]) from None
    except (ValueError, OverflowError, TypeError) as e:
        # A scalar YAML resolves but cannot construct: an impossible date (2026-02-30), an integer
        # over Python's 4,300-digit conversion limit. Named at its line, like any other problem.
        assert loader is not None
        raise error(source, [_unconstructible(loader, root, source, e)]) from None
    except RecursionError:
        # PyYAML composes recursively: a few hundred levels of [[[...]]] exhaust Python's stack.
        assert loader is not None
        mark = loader.get_mark()
        raise error(
            source, [f"{source}:{mark.line + 1}:{mark.column + 1}: YAML nested too deeply to read"]
        ) from None
    finally:
        if loader is not None:
            loader.dispose()
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
        said = merge_typos([humane(err, model) for err in e.errors()])  # type: ignore[arg-type]
        problems += [_located(source, root, loc, msg) for loc, msg in said]
        raise error(source, problems) from None
    if isinstance(obj, Located):
        problems += [_located(source, root, loc, msg) for loc, msg in obj.located_problems()]
    if problems:
        raise error(source, problems)
    return obj


def _unconstructible(loader: yaml.SafeLoader, root: Any, source: str, e: Exception) -> str:
    """The first scalar under ``root`` that cannot be constructed, as ``file:line:col: value: problem``."""
    stack = [root] if root is not None else []
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            # The failed construction left the loader's bookkeeping half done: start each afresh.
            loader.constructed_objects, loader.recursive_objects = {}, {}
            try:
                loader.construct_object(node)
            except (ValueError, OverflowError, TypeError) as problem:
                mark = node.start_mark
                shown = node.value if len(node.value) <= 40 else node.value[:20] + "..."
                return (
                    f"{source}:{mark.line + 1}:{mark.column + 1}: {shown!r} cannot be read: {_short(problem)}"
                )
        elif isinstance(node, yaml.MappingNode):
            stack.extend(item for pair in reversed(node.value) for item in reversed(pair))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed(node.value))
    return f"{source}:1: a value cannot be read: {_short(e)}"


def _short(e: Exception) -> str:
    text = str(e).split(";")[0]
    return text if len(text) <= 120 else text[:117] + "..."


# A policy is a few hundred nodes. Aliases share nodes, so a file of a few lines can stand for billions
# of them once expanded (nine levels of nine aliases: 387 million); everything that walks the document
# (the duplicate-key check, pydantic) would walk every one. Refused past this many.
MAX_NODES = 100_000


def _check_graph(root: Any, source: str, error: type[ConfigError]) -> None:
    """Refuse a document whose aliases expand past ``MAX_NODES`` nodes or contain themselves.

    Iterative (an explicit stack), so neither a deep document nor a cycle can exhaust Python's stack.
    """
    if root is None:
        return
    visits = 0
    on_path = {id(root)}
    stack: list[tuple[Any, Iterator[Any]]] = [(root, _children(root))]
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            continue
        visits += 1
        line = child.start_mark.line + 1
        if visits > MAX_NODES:
            raise error(
                source,
                [
                    f"{source}:{line}: the document's aliases expand it to more than {MAX_NODES:,} "
                    "nodes; a policy is a few hundred: write the values out, or reuse fewer anchors"
                ],
            )
        if id(child) in on_path:
            raise error(source, [f"{source}:{line}: recursive alias: a node that contains itself"])
        if isinstance(child, yaml.CollectionNode):
            on_path.add(id(child))
            stack.append((child, _children(child)))


def _children(node: Any) -> Iterator[Any]:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield key
            yield value
    elif isinstance(node, yaml.SequenceNode):
        yield from node.value


def _located(source: str, root: Any, loc: tuple[Any, ...], msg: str) -> str:
    field = ".".join(str(p) for p in loc) or "(top level)"
    line = line_of(root, loc)
    where = f"{source}:{line}" if line else source
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
