"""Workloads for ``replay``, the demo and the benchmarks: YAML scenarios and recorded traces.

A scenario names the engine profile, the policy and a seed, and describes its traffic with a few
generators that match how long-context lanes are actually used: a burst of independent requests,
closed-loop rounds (a batch job that sends the next round when the last one is done), and agents whose
history grows turn by turn and is served from the radix cache. Traces replay what really arrived:
a JSONL request log, or the sidecar's own decision log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from sidecar.policy.yamlfile import ConfigError, load_model, read_text

ROOT = Path(__file__).resolve().parents[1]


class ScenarioError(ConfigError):
    kind = "scenario"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


TokenRange = tuple[int, int]


class Request(_Strict):
    """One request at a fixed time (traces and hand-written cases)."""

    t: float = Field(ge=0)
    prompt_tokens: int = Field(gt=0)
    max_new_tokens: int = Field(default=256, ge=1)
    prefix: str | None = None
    cached_tokens: int | None = Field(default=None, ge=0)
    priority: int = 0
    # Parallel samples (``n``): the prompt is cached, then n copies of it run (evidence B1).
    samples: int = Field(default=1, ge=1, le=64)


class Requests(_Strict):
    kind: Literal["requests"]
    requests: list[Request]
    retries: int = Field(default=0, ge=0)


class Burst(_Strict):
    """``count`` independent requests, one every ``interval_s``, sizes drawn from a seeded range."""

    kind: Literal["burst"]
    count: int = Field(gt=0)
    start_s: float = Field(default=0, ge=0)
    interval_s: float = Field(ge=0)
    prompt_tokens: TokenRange
    max_new_tokens: int = Field(default=1024, ge=1)
    priority: int = 0
    retries: int = Field(default=0, ge=0)
    samples: int = Field(default=1, ge=1, le=64)


class Rounds(_Strict):
    """Closed loop: ``per_round`` requests at once, the next round when the whole round is done."""

    kind: Literal["rounds"]
    rounds: int = Field(gt=0)
    per_round: int = Field(gt=0)
    start_s: float = Field(default=0, ge=0)
    gap_s: float = Field(default=0, ge=0)
    prompt_tokens: TokenRange
    max_new_tokens: int = Field(ge=1)
    retries: int = Field(default=2, ge=0)
    samples: int = Field(default=1, ge=1, le=64)


class Join(_Strict):
    after: str
    turn: int = Field(ge=1)


class Agents(_Strict):
    """``count`` agents; each turn sends the whole history (cached under the agent's key) plus new input.

    ``join`` starts this group when the first agent of another group has finished turn ``turn``.
    """

    kind: Literal["agents"]
    name: str
    count: int = Field(default=1, gt=0)
    history_tokens: int = Field(gt=0)
    turn_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)
    turns: int = Field(gt=0)
    think_s: float = Field(default=2.0, ge=0)
    start_s: float = Field(default=0, ge=0)
    stagger_s: float = Field(default=1.0, ge=0)
    join: Join | None = None
    priority: int = 0
    retries: int = Field(default=3, ge=0)


class GpuEvent(_Strict):
    """At ``t``, another process on the card holds ``other_process_bytes`` (a neighbour grows)."""

    t: float = Field(ge=0)
    other_process_bytes: ByteSize
    # Under tensor parallelism, the rank whose GPU it happens on (None: every GPU of the lane).
    gpu: int | None = Field(default=None, ge=0)


Workload = Annotated[Requests | Burst | Rounds | Agents, Field(discriminator="kind")]


class Scenario(_Strict):
    name: str
    description: str = ""
    profile: str
    policy: str
    seed: int = 0
    # Virtual seconds after which the replay stops (requests still in flight are reported as such).
    duration_s: float = Field(gt=0)
    # A client that is rejected waits Retry-After (or this, when the failure gave none) and retries.
    retry_after_default_s: float = Field(default=30, gt=0)
    workload: list[Workload] = Field(min_length=1)
    gpu_events: list[GpuEvent] = Field(default_factory=list)
    # Unix time of t = 0 when the requests come from a decision log (its first line's ``ts``): the
    # plot's time axis then reads the log's own clock (UTC). None: virtual time.
    start_unix: float | None = None

    @model_validator(mode="after")
    def _joins_exist(self) -> Scenario:
        names = {w.name for w in self.workload if isinstance(w, Agents)}
        for w in self.workload:
            if isinstance(w, Agents) and w.join is not None and w.join.after not in names:
                raise ValueError(f"agents {w.name!r} joins unknown group {w.join.after!r}")
        return self

    def policy_path(self, base: Path) -> Path:
        p = Path(self.policy)
        for candidate in (base / p, ROOT / p):
            if candidate.exists():
                return candidate
        return ROOT / p


def load_scenario(path: str | Path) -> Scenario:
    return load_model(read_text(path, ScenarioError), Scenario, str(path), ScenarioError)


def load_trace(path: str | Path, *, profile: str, policy: str, seed: int = 0) -> Scenario:
    """A JSONL request log, or the sidecar's decision log, as a scenario of fixed-time requests.

    Request log lines: ``{"t": s, "prompt_tokens": N, "cached_tokens"?: N, "prefix"?: key,
    "max_new_tokens"?: N, "priority"?: N}``. Decision log lines (``"event": "decision"``) are grouped by
    ``request_id``; a request's first line is its arrival, so a night of production decisions can be
    replayed under a changed policy. A ``--log-format json`` stream works as well: its other lines
    are skipped.
    """
    p = Path(path)
    requests: list[Request] = []
    firsts: dict[str, dict] = {}
    has_relative = False  # request-log lines (relative "t"): no wall clock to show
    lines = read_text(p, ScenarioError).splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ScenarioError(str(p), [f"{p}:{n}: not JSON: {e.msg} at column {e.colno}"]) from None
        if not isinstance(rec, dict):
            raise ScenarioError(str(p), [f"{p}:{n}: expected a JSON object"])
        if rec.get("event") == "decision":
            rid = str(rec.get("request_id") or f"line-{n}")
            firsts.setdefault(rid, rec)
            continue
        if "logger" in rec and "level" in rec:
            continue  # another line of a --log-format json stream (start-up, access, ...)
        has_relative = True
        try:
            requests.append(Request.model_validate(rec))
        except ValueError as e:
            raise ScenarioError(str(p), [f"{p}:{n}: {e}"]) from None
    t0: float | None = None
    if firsts:
        t0 = min(float(r["ts"]) for r in firsts.values())
        for rec in firsts.values():
            requests.append(
                Request(
                    t=float(rec["ts"]) - t0,
                    prompt_tokens=int(rec["prompt_tokens"]),
                    max_new_tokens=max(1, int(rec.get("max_new_tokens") or 256)),
                    cached_tokens=int(rec.get("cached_tokens") or 0) or None,
                    priority=int(rec.get("priority") or 0),
                )
            )
    if not requests:
        raise ScenarioError(str(p), [f"{p}: no requests found"])
    requests.sort(key=lambda r: r.t)
    last = requests[-1].t
    return Scenario(
        name=p.stem,
        description=f"trace {p.name}: {len(requests)} requests",
        profile=profile,
        policy=policy,
        seed=seed,
        duration_s=last + 3600,
        workload=[Requests(kind="requests", requests=requests)],
        start_unix=t0 if not has_relative else None,
    )
