"""How far a client may move itself in the hold queue: the policy's bounds on ``priority``.

Why: a client-set ``priority`` (body, or ``X-Admission-Priority``) orders the hold queue, so an
unbounded one lets anyone jump it. The policy either clamps what clients say into a range (the
default range is ``[0, 0]``: every client equal), or maps a header that a trusted gateway sets to
priority classes, with a default for every request without a known class (what clients say about
themselves is then ignored). Pure: values in, a priority out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PriorityBounds:
    minimum: int = 0
    maximum: int = 0
    default: int | None = 0
    # Lower-cased header name set by a gateway the operator trusts; None: no classes.
    class_header: str | None = None
    classes: Mapping[str, int] = field(default_factory=dict)

    def resolve(self, claimed: int | None, headers: Mapping[str, str] | None) -> int | None:
        """The priority a request gets: its trusted class, else the client's claim clamped, else the
        default."""
        if self.class_header is not None:
            value = next(
                (v.strip() for k, v in (headers or {}).items() if k.lower() == self.class_header), None
            )
            return self.classes.get(value, self.default) if value is not None else self.default
        if claimed is None:
            return self.default
        return min(max(claimed, self.minimum), self.maximum)


# No bounds: a claim is taken as is and no claim stays None (the parser's default, for tests and tools).
OPEN = PriorityBounds(minimum=-(2**63), maximum=2**63 - 1, default=None)
