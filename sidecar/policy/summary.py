"""What a policy will do on its lane, in the numbers an SRE thinks in.

A policy is a list of limits; what an on-call engineer needs to know is what they add up to: the longest
prompt this lane will ever take (and which limit says so), how big a 256K prefill is projected to be,
how deep the queues may get, what happens when a signal goes quiet. ``check-policy`` prints this and
``/admission/state`` serves it under ``policy``; both come from :func:`summarize`, so they cannot differ.

Pure: the projection is the gate's own (``core.cost.project_bytes``), the limits are the gate's unfit rules
applied to the lane's constants (the engine's reported values when the caller has them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from sidecar.core.cost import project_bytes, project_own, shape
from sidecar.core.decision import Action
from sidecar.core.rules import Rules
from sidecar.policy.in_force import rules_of
from sidecar.policy.schema import Engine, HeadroomSource, Policy, SignalPolicy, format_size

# Prompt lengths an SRE asks about: the long-context tiers people actually configure.
PROBE_TOKENS = (65_536, 131_072, 262_144, 500_000)
# Beyond any context length shipped today: a transient limit above this is "none".
SEARCH_LIMIT = 1 << 24


@dataclass(frozen=True, slots=True)
class PromptLimit:
    """The longest cold prompt one limit lets through (``None``: this limit sets none)."""

    by: str
    max_prompt_tokens: int | None
    why: str


@dataclass(frozen=True, slots=True)
class Projection:
    prompt_tokens: int
    projected_bytes: int
    fits: bool
    note: str


@dataclass(frozen=True, slots=True)
class PolicySummary:
    name: str
    headroom: str
    transient_cap_bytes: int | None
    max_prompt_tokens: int | None
    limited_by: str | None
    prompt_limits: tuple[PromptLimit, ...]
    projections: tuple[Projection, ...]
    engine_queue_max_requests: int
    pending_prefill_max_tokens: int
    hold_max_held: int
    hold_max_wait_s: float
    on_stale: dict[str, str]
    # Where the idle figure comes from, and what the under-prediction monitor may do.
    idle_free: str
    monitor: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _largest(fits, hi: int) -> int:  # type: ignore[no-untyped-def]
    """Largest n in [0, hi] with fits(n), for a monotone predicate (fits(0) assumed)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _alone(rules: Rules, chunk: int, cap: int, n: int | None) -> int | None:
    """The longest cold prompt the gate admits when it starts its own prefill batch, priced by its own
    chunk schedule (``core/cost.project_own``), where that is longer than ``n`` (the longest with a full
    last chunk). Its last full chunk must end by ``n`` (that chunk alone is a full chunk at that
    context), so the block after the last multiple of ``chunk`` up to ``n`` is the only candidate, and
    in it the price grows with the length: a bisection."""
    if n is None or n < chunk:
        return None
    start = n // chunk * chunk
    best = _largest(lambda k: project_own(rules.cost, start + k, start + k, chunk) <= cap, chunk - 1)
    return start + best if start + best > n else None


def summarize(
    policy: Policy,
    *,
    context_len: int | None = None,
    kv_pool_tokens: int | None = None,
    mamba_slots: int | None = None,
    chunk: int | None = None,
    rules: Rules | None = None,
) -> PolicySummary:
    """The policy's limits on this lane. Keyword arguments are the engine's reports, when known; the
    policy's ``lane`` section is the fallback, exactly as in the gate. ``rules``: the rules in force
    (a running sidecar's, with its measured idle figure and the margin the monitor set), else the
    policy's own."""
    lane = policy.lane
    context = context_len or lane.context_len
    chunk = chunk or lane.chunked_prefill_size
    rules = rules or rules_of(policy)
    # A prompt must leave room for at least one new token inside the context (gate: prompt >= context
    # is unfit), so the context alone allows context - 1.
    limits = [
        PromptLimit("context", context - 1, f"prompt + max_new_tokens must stay within {context:,}"),
        _transient_limit(policy, rules, chunk),
        *_pool_limits(policy, kv_pool_tokens or lane.kv_pool_tokens, mamba_slots or lane.mamba_slots),
    ]
    bounded = [lim for lim in limits if lim.max_prompt_tokens is not None]
    tightest = min(bounded, key=lambda lim: lim.max_prompt_tokens or 0) if bounded else None
    return PolicySummary(
        name=policy.name,
        headroom=policy.vram.headroom.value
        if rules.vram.headroom is policy.vram.headroom
        else f"{rules.vram.headroom.value} until idle free memory is measured, then {policy.vram.headroom.value}",
        transient_cap_bytes=rules.vram.transient_cap(),
        max_prompt_tokens=tightest.max_prompt_tokens if tightest else None,
        limited_by=tightest.by if tightest else None,
        prompt_limits=tuple(limits),
        projections=_projections(rules, chunk, tightest),
        engine_queue_max_requests=policy.engine_queue.max_requests,
        pending_prefill_max_tokens=policy.pending_prefill.max_tokens,
        hold_max_held=policy.hold.max_held,
        hold_max_wait_s=policy.hold.max_wait_s,
        on_stale=_on_stale(policy),
        idle_free=_idle_free(policy, rules),
        monitor=_monitor(policy),
    )


def _transient(rules: Rules, chunk: int, n: int) -> int:
    """The projected prefill transient of a cold prompt of ``n`` tokens."""
    return project_bytes(rules.cost, shape(n, n, chunk))


def _transient_limit(policy: Policy, rules: Rules, chunk: int) -> PromptLimit:
    """The longest prompt whose transient fits the lane's cap (none without a cap)."""
    cap = rules.vram.transient_cap()
    if cap is None:
        why = "no cap: headroom is live GPU free memory, a request waits until its transient fits"
        if policy.vram.idle_free_auto:
            why = (
                "no cap until the sidecar has measured idle free memory (vram.idle_free_bytes: auto); "
                "meanwhile headroom is live GPU free memory and a request waits until its transient fits"
            )
        return PromptLimit("transient", None, why)
    n: int | None
    if _transient(rules, chunk, 1) > cap:
        n = 0
    elif _transient(rules, chunk, SEARCH_LIMIT) <= cap:
        n = None
    else:
        n = _largest(lambda k: _transient(rules, chunk, k) <= cap, SEARCH_LIMIT)
    how = (
        f"idle budget {format_size(rules.vram.idle_free_bytes)}"
        f"{' (measured by the sidecar)' if policy.vram.idle_free_auto else ''} - reserve "
        f"{format_size(policy.vram.reserve_bytes)}"
        if policy.vram.max_transient_bytes is None
        else "vram.max_transient_bytes"
    )
    own = policy.guard.enabled and policy.experimental.own_schedule_pricing
    alone = _alone(rules, chunk, cap, n) if own else None
    if alone is not None:
        how += (
            f"; alone, priced by its own chunk schedule, up to {alone:,} where its last chunk falls "
            "best (an engine exporting its prefill counters)"
        )
    return PromptLimit("transient", n, f"projected prefill transient <= {format_size(cap)}: {how}")


def _pool_limits(policy: Policy, pool: int | None, slots: int | None) -> list[PromptLimit]:
    """The KV pool's and the Mamba slots' limits, where the lane has them."""
    limits = []
    if pool is not None:
        room = pool - policy.kv.reserve_tokens
        limits.append(
            PromptLimit("kv_pool", max(0, room), f"KV pool {pool:,} - reserve {policy.kv.reserve_tokens:,}")
        )
    m = policy.mamba
    if m is not None and slots is not None:
        room = slots - m.reserve_slots - m.slots_per_request
        n: int | None
        if room < 0:
            n = 0
        elif m.checkpoint_interval_tokens:
            n = room * m.checkpoint_interval_tokens
        else:
            n = None
        per = (
            f" + 1 per {m.checkpoint_interval_tokens:,} prompt tokens" if m.checkpoint_interval_tokens else ""
        )
        limits.append(
            PromptLimit(
                "mamba_slots",
                n,
                f"{m.slots_per_request} slot(s) per request{per} within {slots} - reserve {m.reserve_slots}",
            )
        )
    return limits


def _projections(rules: Rules, chunk: int, tightest: PromptLimit | None) -> tuple[Projection, ...]:
    """The transient of each probe length, and whether the tightest limit lets it in."""
    max_prompt = tightest.max_prompt_tokens if tightest else None
    out = []
    for n in PROBE_TOKENS:
        if max_prompt is not None and n > max_prompt:
            fits, note = False, f"unfit: over the {tightest.by} limit" if tightest else "unfit"
        else:
            fits, note = True, "fits an idle lane"
        out.append(Projection(n, _transient(rules, chunk, n), fits, note))
    return tuple(out)


def _idle_free(policy: Policy, rules: Rules) -> str:
    v = policy.vram
    if not v.idle_free_auto:
        return (
            "not used"
            if v.idle_free_figure is None
            else f"{format_size(v.idle_free_figure)} (the policy's figure)"
        )
    if rules.vram.idle_free_bytes is None:
        return (
            "auto: measured by the sidecar once the engine is idle, again after each engine restart; "
            "until then headroom is live GPU free memory"
        )
    return f"auto: {format_size(rules.vram.idle_free_bytes)}, measured by the sidecar with the engine idle"


def _monitor(policy: Policy) -> str:
    m, cost = policy.monitor, policy.cost
    limits = (
        f"by more than {format_size(m.min_bytes)}"  # tolerance 0: every byte past min_bytes counts
        if m.tolerance == 0
        else f"by more than {m.tolerance:.1%} and {format_size(m.min_bytes)}"
    )
    if cost.calibrated_ratio is None:
        seen = f"(over the projection {limits})"
    else:
        seen = f"(over the cost terms x{cost.calibrated_ratio:g} {limits}: cost.calibrated_ratio, not the margin)"
    if not m.raise_margin:
        said = f"under-predictions {seen} are counted and logged; cost.margin stays as written"
    else:
        cap = max(m.max_margin, policy.cost.margin)
        said = (
            f"under-predictions {seen} are counted and logged, and raise cost.margin "
            f"({policy.cost.margin:g}) to what they showed x{1 + m.safety:g}"
            + (f" (at least + {m.step:g})" if m.step else "")
            + f", up to {cap:g} and never so far that a prompt the lane served becomes unfit, until the"
            " next policy load; an engine restart with admitted work raises it so that work would not"
            " have fitted (docs/robustness.md)"
        )
    # What the margin leaves above what a reading is compared with.
    ratio = cost.calibrated_ratio or 1.0
    slack = cost.margin / ratio - 1.0
    if m.tolerance > 0 and m.tolerance >= slack:
        # An overrun between the margin's slack and the tolerance is neither covered nor counted: it
        # kills a prompt admitted at the edge of the policy before the margin can rise (evidence D17).
        # A tolerance of 0 counts every overrun past min_bytes: nothing finer to ask for.
        said += (
            f"; note: the margin leaves {slack:.1%} of a peak, not more than that tolerance: an overrun "
            "in between is neither covered nor counted (monitor.tolerance below "
            + (
                "cost.margin - 1"
                if cost.calibrated_ratio is None
                else "cost.margin / cost.calibrated_ratio - 1"
            )
            + " closes it)"
        )
    return said


def _blind(sp: SignalPolicy, policy: Policy) -> str:
    return {
        Action.HOLD: f"requests are held, up to {policy.hold.max_wait_s:g} s, then 503 hold_timeout",
        Action.REJECT: "requests are rejected at once with 503 signals_stale",
        Action.ADMIT: "requests are admitted blind (that signal's constraints pass)",
    }[sp.on_stale]


def _sooner(e: Engine) -> str:
    """The reads after an end (``engine.poll_after_release_s``), when on."""
    if not e.poll_after_release_s:
        return ""
    gap = min(e.poll_after_release_s, e.poll_interval_s)
    return f", every {gap:g} s for {e.poll_interval_s:g} s after a response ends while requests are held"


def _on_stale(policy: Policy) -> dict[str, str]:
    e, g = policy.engine, policy.gpu
    out = {
        "engine": f"older than {e.max_age_s:g} s (polled every {e.poll_interval_s:g} s{_sooner(e)}): "
        f"{_blind(e, policy)}; after {e.unavailable_after_failures} failed reads in a row: "
        + (
            f"engine_unavailable, requests are held (a restart ridden through) up to {policy.hold.max_wait_s:g} s, "
            "then 503 hold_timeout"
            if e.on_stale is Action.HOLD
            else "503 engine_unavailable"
        ),
    }
    blind = f"older than {g.max_age_s:g} s (polled every {g.poll_interval_s:g} s): {_blind(g, policy)}"
    if policy.vram.headroom is HeadroomSource.IDLE_BUDGET:
        out["gpu"] = (
            "not used to admit (headroom is the idle budget); when fresh, other processes' growth "
            f"beyond {format_size(policy.vram.other_processes_bytes)} comes out of the budget"
            if policy.vram.other_processes_bytes is not None
            else "not used to admit (headroom is the idle budget)"
        )
        if policy.vram.idle_free_auto:
            out["gpu"] = f"until idle free memory is measured, {blind}; then " + out["gpu"]
    elif not g.required:
        out["gpu"] = "optional: without a GPU source the VRAM constraint is off"
    else:
        out["gpu"] = blind
    return out


def render(summary: PolicySummary) -> list[str]:
    """The summary as lines for a terminal (``check-policy``)."""
    s = summary
    lines = ["What this policy does on its lane:"]
    if s.max_prompt_tokens is None:
        lines.append("  largest prompt it can ever admit: no limit of its own")
    else:
        lines.append(
            f"  largest prompt it can ever admit: {s.max_prompt_tokens:,} tokens (set by {s.limited_by})"
        )
    for lim in s.prompt_limits:
        n = "no limit" if lim.max_prompt_tokens is None else f"{lim.max_prompt_tokens:,} tokens"
        lines.append(f"    by {lim.by + ':':<12} {n:>16}  ({lim.why})")
    lines.append(f"  projected prefill transient (cold prompt, headroom: {s.headroom}):")
    for p in s.projections:
        lines.append(
            f"    {_tokens(p.prompt_tokens):>5} tokens: {format_size(p.projected_bytes):>10}  {p.note}"
        )
    lines.append(
        f"  queues: engine queue <= {s.engine_queue_max_requests} requests, pending prefill <= "
        f"{s.pending_prefill_max_tokens:,} tokens, hold queue <= {s.hold_max_held} requests for "
        f"<= {s.hold_max_wait_s:g} s"
    )
    for signal, what in s.on_stale.items():
        lines.append(f"  {signal} signal: {what}")
    lines.append(f"  idle free memory: {s.idle_free}")
    lines.append(f"  monitor: {s.monitor}")
    return lines


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{math.floor(n / 1000)}K"
